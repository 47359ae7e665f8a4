"""`globalkv doctor`: a live cluster's diagnostic path, one stage per module.

`pools` (the gateway's workers), `directories` (each prefill's bootstrap directory and
rank addresses), `index` (what the indexer follows and how fresh it is), `routing` (can
the prefix policy work), `probe` (a request through it all, by PD stage); `diagnose`
walks them in that order and `report` shows the result.
"""
