"""Canonical identifiers: what a user may write for a GPU model, a cloud region or a grid zone, and what
heliotrope turns it into (or why it refuses)."""

from __future__ import annotations

import pytest

from broker import ids
from broker.ids import UnknownIdentifier, gpu_model, grid_zone, region

# --- GPU models ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        pytest.param("NVIDIA A100-SXM4-80GB", "a100-80gb", id="nvidia-smi's name for an SXM A100 80GB is a100-80gb"),
        pytest.param("NVIDIA A100-SXM4-40GB", "a100-40gb", id="nvidia-smi's name for an SXM A100 40GB is a100-40gb"),
        pytest.param("NVIDIA A100 80GB PCIe", "a100-80gb", id="the PCIe A100 80GB is the same model as the SXM one"),
        pytest.param("Tesla T4", "t4", id="Tesla T4 is t4"),
        pytest.param("NVIDIA H100 80GB HBM3", "h100-80gb", id="nvidia-smi's name for an H100 SXM is h100-80gb"),
        pytest.param("NVIDIA H100 NVL", "h100-94gb", id="the H100 NVL is the 94 GB model, not the 80 GB one"),
        pytest.param("NVIDIA L4", "l4", id="NVIDIA L4 is l4"),
        pytest.param("Tesla V100-SXM2-32GB", "v100-32gb", id="a 32 GB V100 is v100-32gb"),
        pytest.param(
            "NVIDIA-A100-SXM4-80GB", "a100-80gb",
            id="the GPU feature discovery node label, written with dashes, is a100-80gb",
        ),
    ],
)
def test_vendor_product_names_map_to_canonical_models(written: str, canonical: str) -> None:
    assert gpu_model(written) == canonical


@pytest.mark.parametrize(
    ("sku", "canonical"),
    [
        pytest.param("nvidia-tesla-a100", "a100-40gb", id="GKE's accelerator nvidia-tesla-a100 is the 40 GB A100"),
        pytest.param("h100-80gb-mega", "h100-80gb", id="GKE's accelerator h100-80gb-mega is h100-80gb"),
        pytest.param("a2-ultragpu", "a100-80gb", id="GCP's a2-ultragpu machines carry a100-80gb"),
        pytest.param("p4d", "a100-40gb", id="AWS p4d instances carry a100-40gb"),
        pytest.param("p5", "h100-80gb", id="AWS p5 instances carry h100-80gb"),
        pytest.param("g6e", "l40s-48gb", id="AWS g6e instances carry l40s-48gb"),
    ],
)
def test_cloud_skus_map_to_canonical_models(sku: str, canonical: str) -> None:
    assert gpu_model(sku) == canonical


@pytest.mark.parametrize(
    "written",
    [
        pytest.param("A100-80GB", id="upper case is the same model"),
        pytest.param("  a100-80gb  ", id="surrounding spaces are ignored"),
        pytest.param("nvidia_a100_sxm4_80gb", id="underscores are read as dashes"),
        pytest.param("NVIDIA  A100 SXM4   80GB", id="runs of spaces are read as one dash"),
        pytest.param("nvidia_ a100-sxm4 _80gb", id="mixed runs of spaces and underscores are read as one dash"),
    ],
)
def test_spelling_variants_of_a_model_name_are_the_same_model(written: str) -> None:
    assert gpu_model(written) == "a100-80gb"


def test_every_canonical_id_maps_to_itself() -> None:
    assert [gpu_model(m) for m in ids.GPU_MODEL_IDS] == list(ids.GPU_MODEL_IDS)


@pytest.mark.parametrize(
    "typo",
    [
        pytest.param("a1000", id="a typo of a100 is not silently a new model"),
        pytest.param("h100-90gb", id="a memory size the H100 never had is unknown"),
        pytest.param("", id="an empty model name is unknown"),
    ],
)
def test_unknown_gpu_model_is_an_error_that_lists_the_known_models(typo: str) -> None:
    with pytest.raises(UnknownIdentifier) as err:
        gpu_model(typo)
    message = str(err.value)
    assert f"unknown GPU model {typo!r}" in message
    for known in ("a100-40gb", "h100-80gb", "l4", "t4"):
        assert known in message


def test_unknown_gpu_model_is_a_value_error_so_pydantic_reports_it_as_a_field_error() -> None:
    assert issubclass(UnknownIdentifier, ValueError)


# --- regions ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        pytest.param("gcp:us-east1-b", "gcp:us-east1", id="a GCP zone is reduced to its region"),
        pytest.param("gcp:us-east1", "gcp:us-east1", id="a GCP region is kept as it is"),
        pytest.param("gcp:northamerica-northeast2", "gcp:northamerica-northeast2", id="long GCP region names work"),
        pytest.param("aws:eu-west-1a", "aws:eu-west-1", id="an AWS availability zone is reduced to its region"),
        pytest.param("aws:us-gov-west-1", "aws:us-gov-west-1", id="AWS GovCloud regions work"),
        pytest.param("AZURE:eastus", "azure:eastus", id="the provider and region are lower-cased"),
        pytest.param("GCP:US-EAST1-B", "gcp:us-east1", id="an upper-case zone is lower-cased and reduced"),
        pytest.param(" onprem:lab-1 ", "onprem:lab-1", id="an on-premises region is any simple name"),
    ],
)
def test_regions_are_canonical_provider_and_region(written: str, canonical: str) -> None:
    assert region(written) == canonical


def test_a_region_without_provider_is_an_error_that_shows_the_expected_form() -> None:
    with pytest.raises(UnknownIdentifier) as err:
        region("us-east1")
    message = str(err.value)
    assert "'us-east1'" in message
    assert "provider:region" in message
    assert "gcp:us-east1" in message


def test_an_unknown_provider_is_an_error_that_lists_the_known_providers() -> None:
    with pytest.raises(UnknownIdentifier) as err:
        region("ibm:us-south")
    message = str(err.value)
    assert "unknown cloud provider 'ibm'" in message
    for provider in ids.PROVIDERS:
        assert provider in message


@pytest.mark.parametrize(
    "written",
    [
        pytest.param("gcp:useast1", id="a GCP region without its dash is malformed"),
        pytest.param("aws:eu-west", id="an AWS region without its number is malformed"),
        pytest.param("azure:east us", id="an Azure region with a space is malformed"),
        pytest.param("gcp:", id="a provider with no region is malformed"),
    ],
)
def test_a_malformed_region_name_is_an_error_naming_the_provider(written: str) -> None:
    provider = written.partition(":")[0]
    with pytest.raises(UnknownIdentifier, match=f"not a well-formed {provider} region name"):
        region(written)


# --- grid zones ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        pytest.param("CAISO", "US-CAL-CISO", id="CAISO is California's zone US-CAL-CISO"),
        pytest.param("caiso", "US-CAL-CISO", id="aliases are matched in any case"),
        pytest.param("ERCOT", "US-TEX-ERCO", id="ERCOT is Texas's zone US-TEX-ERCO"),
        pytest.param("DE", "DE-LU", id="DE is the German-Luxembourg bidding zone DE-LU"),
        pytest.param("de-lu", "DE-LU", id="a known zone id in lower case is upper-cased"),
        pytest.param("great britain", "GB", id="a spelled-out alias with a space is matched"),
    ],
)
def test_grid_zone_aliases_map_to_the_carbon_data_zone_ids(written: str, canonical: str) -> None:
    assert grid_zone(written) == canonical


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        pytest.param("us-nw-pacw", "US-NW-PACW", id="a well-formed zone outside the data is kept in upper case"),
        pytest.param("NO-NO1", "NO-NO1", id="a zone with a digit is kept as written"),
        pytest.param(" IS ", "IS", id="a bare country code is a zone"),
    ],
)
def test_well_formed_unknown_grid_zones_are_accepted_as_written_in_upper_case(written: str, canonical: str) -> None:
    assert grid_zone(written) == canonical


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param("not a zone!", id="words with punctuation are not a zone"),
        pytest.param("X", id="one letter is not a zone"),
        pytest.param("12-AB", id="a zone must start with a two-letter country code"),
        pytest.param("US--CAL", id="an empty zone part is not a zone"),
        pytest.param("", id="an empty string is not a zone"),
    ],
)
def test_garbage_grid_zones_are_rejected_with_an_example(garbage: str) -> None:
    with pytest.raises(UnknownIdentifier) as err:
        grid_zone(garbage)
    message = str(err.value)
    assert "is not a grid zone id" in message
    assert "DE-LU" in message


def test_job_ids_made_within_one_millisecond_or_as_the_clock_steps_back_sort_in_the_order_they_were_made(
        monkeypatch):
    """The queue orders jobs of one priority and age by id: jobs submitted within a millisecond keep their order
    (their ids' random part used to order them at random)."""
    import time

    from broker import jobs
    now = [1_764_000_000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    made = [jobs.new_job_id() for _ in range(500)]  # one millisecond
    now[0] -= 5.0  # the clock steps back
    made += [jobs.new_job_id() for _ in range(10)]
    now[0] += 60.0
    made += [jobs.new_job_id() for _ in range(10)]
    assert made == sorted(made) and len(set(made)) == len(made)
    assert all(len(i) == 18 for i in made)
