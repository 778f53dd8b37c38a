"""Tools built on training: ``check`` (do N processes compute what 1 does?), ``bench`` (throughput and scaling
beside a cost model), ``doctor`` (is this machine ready?) and ``show-data`` (image grids, with predictions)."""
