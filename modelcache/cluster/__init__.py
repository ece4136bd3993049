"""modelcache beyond one machine: one daemon per node of a Ray cluster, requests routed to where a model is warm.

`routing` (pure: node views from daemon stats, the locality policy) needs nothing; `rayserve` needs the
`[ray]` extra.
"""
