"""The `trajstore` command: the store's commands, and the others loaded on first use.

Loading on first use keeps `trajstore --help` fast and lets a store-only install (no torch, no
vLLM, no FastAPI) run the store's commands; a command whose part is missing says so.
"""

from __future__ import annotations

from trajstore.store.cli import main

main.lazy.update(
    {
        "proxy": "trajstore.proxy.cli:proxy",
        "relay": "trajstore.proxy.cli:relay",
        "replay": "trajstore.trainer.cli:replay",
        "up": "trajstore.stack:up",
        "demo": "trajstore.demo:demo",
        "ui": "trajstore.viewer.cli:ui",
        "run": "trajstore.trials:run",
        "train": "trajstore.train_cli:train",
        "score": "trajstore.teacher:score",
    }
)

__all__ = ["main"]
