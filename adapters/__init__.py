"""Site adapters: one module per kind of site. See ``adapters.base`` for the protocols they implement."""
