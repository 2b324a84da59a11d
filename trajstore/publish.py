"""Publishing a policy: the trained weights into a running vLLM, and the new version to the proxy.

    save      the weights (safetensors) into `<publish_dir>/v<N>`
    begin     the proxy's `POST /admin/switches {"version": "N", "engines": [...], "checkpoint"}`:
              it cuts the turns in flight on the engine where it received them and holds new
              requests (`proxy.switching`); it answers once the engine generates nothing of ours
    reload    `POST /pause?mode=keep` (anything not the proxy's is frozen, not drained), then
              `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": ...}}`:
              every worker loads the new weights in place (no restart, no new KV cache), then
              `POST /resume`
    live      `POST /admin/switches/{id}/live`: the cut turns continue token-in on version N,
              stitched into the answers their agents are reading, and the held requests go;
              or, when the reload failed, `POST /admin/switches/{id}/failed`: they go on, on the
              version before

No turn in flight is waited for: a publish costs the reload, however long the agents' turns.
`Publisher(drain=True)` publishes as before (`POST /pause?mode=wait`: the engine first finishes
every turn in flight; the version told to the proxy afterwards), the baseline of
`benchmarks/publish.py`.

Why a full weight reload rather than runtime LoRA adapters: the trainer trains every weight (a
LoRA adapter would need a PEFT model on the trainer side and LoRA kernels on the engine's, and
changes what is learned), and vLLM 0.32 reloads in place with the same endpoint on its CPU build
and on a GPU: 0.1-0.2 s for the tiny model here, the cost of reading the files. The endpoints
are vLLM's development ones: the engine must run with `VLLM_SERVER_DEV_MODE=1`.

Tied embeddings: vLLM's in-place reload does not load a tied `lm_head` (it logs
"ParallelLMHead: Failed to load weights" and keeps the old tensor), so the served model would
mix new embeddings with the old output layer. `untied_copy` writes the model with its own
`lm_head` (the same values), which reloads exactly: vLLM's logprobs after a reload equal
transformers' on the published weights to ~1e-6 (measured, and tested in `tests/test_live.py`).

Attribution is exact: every token is recorded with the version whose weights produced it, as
spans over each turn's tokens (`store.payloads.VersionSpan`), a turn cut by the switch with two.
With `drain=True`, a request the proxy receives while the engine is paused is recorded with the
old version but generated with the new weights (its lag overstated by one).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import httpx
import torch


class PublishFailed(RuntimeError):
    """The engine or the proxy refused a step of the publication."""


def untied_copy(model_dir: Path, out_dir: Path) -> Path:
    """A copy of the model in `model_dir` whose `lm_head` is its own tensor; returns `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if model.config.tie_word_embeddings:
        model.config.tie_word_embeddings = False
        weight = model.get_input_embeddings().weight.detach().clone()
        model.lm_head.weight = torch.nn.Parameter(weight)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


class Publisher:
    """Publishes each new policy of a trainer to one vLLM engine behind a trajstore proxy."""

    def __init__(
        self,
        engine_url: str,
        proxy_url: str,
        publish_dir: Path,
        *,
        admin_key: str | None = None,
        keep: int = 2,
        drain: bool = False,
    ) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.proxy_url = proxy_url.rstrip("/")
        self.publish_dir = publish_dir
        self.keep = keep  #: published versions kept on disk (the engine reads the newest)
        self.drain = drain  #: publish by draining the engine first (the old way, a baseline)
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.http = httpx.AsyncClient(timeout=120, headers=headers)

    async def close(self) -> None:
        """Close the HTTP client."""
        await self.http.aclose()

    async def _post(self, url: str, **kwargs: Any) -> httpx.Response:
        response = await self.http.post(url, **kwargs)
        if response.status_code >= 400:
            raise PublishFailed(f"POST {url}: {response.status_code} {response.text[:300]}")
        return response

    async def publish(self, model: Any, version: int) -> Path:
        """Save `model` as policy `version`, load it into the engine, tell the proxy."""
        path = self.publish_dir / f"v{version}"
        # In a thread: the proxy may share this event loop, and its agents must not stall.
        await asyncio.to_thread(model.save_pretrained, path)
        await self.load(path, version)
        self._prune(version)
        return path

    async def load(self, model_dir: Path, version: int) -> None:
        """Load the weights in `model_dir` into the engine as policy `version`."""
        if self.drain:
            await self._drain_and_load(model_dir, version)
            return
        began = await self._post(
            f"{self.proxy_url}/admin/switches",
            json={"version": str(version), "engines": [self.engine_url],
                  "checkpoint": str(model_dir)},
        )  # fmt: skip
        switch = f"{self.proxy_url}/admin/switches/{began.json()['switch_id']}"
        try:
            await self._reload(model_dir, mode="keep")
        except BaseException as exc:
            # The proxy lets what it held go on, on the version the engine still serves.
            reason = f"{type(exc).__name__}: {exc}"[:500]
            await self._post(f"{switch}/failed", json={"reason": reason})
            raise
        await self._post(f"{switch}/live")

    async def set_version(self, version: int) -> None:
        """Tell the proxy that its engines now serve policy `version` (the drain's way)."""
        await self._post(
            f"{self.proxy_url}/admin/engines/policy-version", json={"version": str(version)}
        )

    async def _drain_and_load(self, model_dir: Path, version: int) -> None:
        """Today's publish before switches: the engine finishes what it generates first."""
        await self._post(f"{self.engine_url}/pause", params={"mode": "wait"})
        try:
            await self._post(
                f"{self.engine_url}/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}},
            )
            await self.set_version(version)
        finally:
            await self._post(f"{self.engine_url}/resume")

    async def _reload(self, model_dir: Path, *, mode: str) -> None:
        await self._post(f"{self.engine_url}/pause", params={"mode": mode})
        try:
            await self._post(
                f"{self.engine_url}/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}},
            )
        finally:
            await self._post(f"{self.engine_url}/resume")

    def _prune(self, version: int) -> None:
        for old in self.publish_dir.glob("v*"):
            number = old.name[1:]
            if number.isdigit() and int(number) <= version - self.keep:
                shutil.rmtree(old, ignore_errors=True)
