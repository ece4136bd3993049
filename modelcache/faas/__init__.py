"""FaaS invocation traces and their replay against the eviction policies: read the Azure Functions
trace format (trace.py), make traces of its published shape (synthetic.py), replay them against a model
of the tiered cache (simulate.py) and sweep policies and capacities (sweep.py)."""
