"""kvsieve on Ray Serve: an ingress with kvsieve's OpenAI API, engine-replica
deployments each owning one SGLang engine with the kvsieve plugin, and a
metrics hub that gathers every replica's /metrics. See docs/scale.md."""
