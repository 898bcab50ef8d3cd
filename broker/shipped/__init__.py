"""Where the files heliotrope ships beside its code are: ``config/`` (the demo's federation, the example site
and job specs) and ``data/`` (small slices of real data, their provenance in data/SOURCES.md).

In a checkout (and an editable install) they are the repository's own ``config/`` and ``data/``. In an
installed wheel, and so in the container image, they are this package's data, ``broker/shipped/config`` and
``broker/shipped/data`` (pyproject.toml maps the two folders there). Either way the two folders sit side by
side, so a path in a shipped config that reads the data relative to its own folder (config/demo.yaml's
``../data/carbon``) finds it in both.
"""

from importlib.resources import files
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def shipped(folder: str) -> Path:
    """The shipped folder ``folder`` (``"config"`` or ``"data"``): the installed package's copy where there is
    one, else the checkout's."""
    installed = Path(str(files(__name__) / folder))
    return installed if installed.is_dir() else CHECKOUT / folder


CONFIG = shipped("config")
DATA = shipped("data")
