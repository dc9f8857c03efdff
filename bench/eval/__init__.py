"""Accuracy and fidelity of every kv_policy against its budget,
measured through a real kvsieve server: `python -m bench.eval run|report`."""
