"""trajstore: record what agents say to a model, token for token, and replay it for training.

One installed name over the project's three parts, whose folders stay at the top level of the
repository (the links `trajstore/store`, `trajstore/proxy` and `trajstore/trainer` point at them):

- `trajstore.store`: the event log in PostgreSQL, its projection into training samples, SQL views;
- `trajstore.proxy`: the recording proxy in front of inference engines;
- `trajstore.trainer`: replay of samples into tensor batches, off-policy losses, trainer adapters.

This package itself is the room above them, which runs them all: the command line
(`trajstore.cli`), the local stack (`trajstore.stack`, `trajstore up`), the demo
(`trajstore.demo`), task directories (`trajstore.tasks`, `trajstore.trials`, `trajstore run`),
the trajectory viewer (`trajstore.viewer`, `trajstore ui`), the generated tiny model
(`trajstore.tiny_model`) and a local vLLM on it (`trajstore.vllm_server`). Arrows point down:
store/ imports none of the others, trainer/ and proxy/ import only store/ (tests/test_house.py).
"""
