"""Calibrating the cost model against a real torch decode step (``llmsim calibrate``).

``design`` says which shapes are measured (a fit grid and a disjoint held-out grid),
``bench`` times them in torch (imported only there), ``fit`` prices the same
shapes with llmsim's own :class:`~llmsim.cost.roofline.CostModel` and fits its
efficiencies and overheads, ``profile_yaml`` writes the result as a hardware
profile and transfers efficiencies to another profile's peaks.
"""
