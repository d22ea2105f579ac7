"""Power-of-two scales for TI's TIDL (tda4vm): each scale chosen on the grid (``scales``), the
residual streams' factors that put their ranges best on it (``residual_streams``, ``grid``), and
what the report records of them (``record``)."""
