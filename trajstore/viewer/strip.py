"""The token strip: a turn's tokens as the sample the trainer sees holds them.

A turn's part of its sample is its *glue* (the prompt tokens the sample did not hold yet: the
whole prompt for a branch's first turn, else the tool results, user messages and template tokens
since the previous completion; loss mask 0) followed by its *completion* (loss mask 1, coloured
by its behaviour logprob). `turn_spans` takes those parts from the sample as it was built
(`Sample.turn_offsets`): no turn's prompt is made whole, so a session of thousands of turns
costs its samples' length once.

The strip is written here as HTML rather than in a template: a turn holds thousands of tokens,
and a Python join is several times faster than a template loop.
"""

from __future__ import annotations

import colorsys
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from markupsafe import Markup, escape

from trajstore.store.samples import Sample
from trajstore.store.tokens import decode_logprobs, decode_token_ids, encode_token_ids

#: A glue longer than this shows its first and last `_KEEP` tokens (and the divergence's).
_LONG_GLUE = 3000
_KEEP = 1000
_AROUND_DIVERGENCE = 100


def logprob_colour(logprob: float) -> tuple[int, int, int]:
    """The background of a generated token: red at probability 0, through yellow, to green at 1.

    Linear in probability (exp(logprob)), which is how people read "unsure"; pale enough that
    the text stays readable.
    """
    probability = min(max(math.exp(logprob), 0.0), 1.0)
    red, green, blue = colorsys.hls_to_rgb(probability / 3, 0.8, 0.75)
    return round(red * 255), round(green * 255), round(blue * 255)


def _packed(values: bytes | Sequence[int]) -> bytes:
    return values if isinstance(values, bytes) else encode_token_ids(list(values))


@dataclass(frozen=True)
class TurnSpan:
    """Where one turn's tokens sit in a sample: glue [glue_start, start), completion
    [start, end)."""

    sample: Sample
    turn: int
    glue_start: int
    start: int
    end: int


def turn_spans(sample: Sample) -> list[TurnSpan]:
    """Each of the sample's turns, with the places of its glue and its completion (as the
    sample was built: `Sample.turn_offsets`, linear in its turns)."""
    return [TurnSpan(sample, *offsets) for offsets in sample.turn_offsets()]


@dataclass(frozen=True)
class Strip:
    """Tokens to draw: ids, loss mask, logprobs (NaN: no behaviour logprob), and a mark."""

    title: str
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    diverged_at: int | None = None  #: index into `ids` of the first token that diverged
    divergence: str = ""  #: what the mark says
    #: The images whose placeholder ids start in the strip, in order: the sample's image
    #: entry (`store.samples`) with `n` (its number in the sample), `lo` and `hi` (its run's
    #: indices into `ids`).
    images: tuple[dict[str, Any], ...] = ()

    @classmethod
    def of_span(cls, span: TurnSpan, title: str, divergence: tuple[int, str] | None) -> Strip:
        """The glue and completion of one turn of a sample."""
        lo, hi = span.glue_start, span.end
        sample = span.sample
        ids = np.asarray(sample.token_array()[lo:hi]).tolist()
        mask = list(sample.mask_bytes()[lo:hi])
        logprobs = np.asarray(sample.logprob_array()[lo:hi], np.float64).tolist()
        images = tuple(
            {**image, "n": n, "lo": image["start"] - lo, "hi": min(image["end"], hi) - lo}
            for n, image in enumerate(sample.images)
            if image["start"] is not None and lo <= image["start"] < hi
        )
        if divergence is None:
            return cls(title, ids, mask, logprobs, images=images)
        position, why = divergence
        return cls(title, ids, mask, logprobs, position - lo, why, images)

    @classmethod
    def of_tokens(cls, title: str, ids: bytes | Sequence[int],
                  logprobs: bytes | Sequence[float]) -> Strip:  # fmt: skip
        """Generated tokens outside any sample (a failed or unfinished turn), as recorded."""
        id_list = np.asarray(decode_token_ids(_packed(ids))).tolist()
        raw = logprobs if isinstance(logprobs, bytes) else None
        values = (
            np.asarray(decode_logprobs(raw), np.float64).tolist() if raw is not None
            else [float(v) for v in logprobs]
        )  # fmt: skip
        if len(values) != len(id_list):
            values = [math.nan] * len(id_list)
        return cls(title, id_list, [1] * len(id_list), values)

    def shown(self) -> list[tuple[int, int]]:
        """The index ranges drawn: all of it, or a long glue's ends and the divergence."""
        n = len(self.ids)
        glue = next((i for i, m in enumerate(self.mask) if m), n)
        if glue <= _LONG_GLUE:
            return [(0, n)]
        keep = [(0, _KEEP), (glue - _KEEP, n)]
        if self.diverged_at is not None:
            keep.append((self.diverged_at - _AROUND_DIVERGENCE,
                         self.diverged_at + _AROUND_DIVERGENCE))  # fmt: skip
        return _merged((max(a, 0), min(b, n)) for a, b in keep)


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def render(strip: Strip, texts: list[str] | None) -> Markup:
    """The strip as spans: text (or id), `title` for hover, `data-*` for tests and scripts."""
    parts: list[str] = []
    mark = strip.diverged_at
    in_image = {i: image["n"] for image in strip.images for i in range(image["lo"], image["hi"])}
    position = 0
    for lo, hi in strip.shown():
        if lo > position:
            parts.append(f'<span class="elided">… {lo - position} tokens …</span>')
        for i in range(lo, hi):
            token = strip.ids[i]
            text = f"⟨{token}⟩" if texts is None else texts[i]
            shown = escape(text if text.strip() or "\n" in text else text.replace(" ", "␣") or "∅")
            about = escape(repr(text)) if texts is not None else "(no text)"
            if i == mark:
                parts.append(f'<span class="divergence" title="{escape(strip.divergence)}">'
                             "</span>")  # fmt: skip
            extra = " diverged" if i == mark else ""
            if i in in_image:  # an image's placeholder: the thumbnail beside says which
                extra += " img"
            data = f' data-image="{in_image[i]}"' if i in in_image else ""
            if not strip.mask[i]:
                parts.append(f'<span class="t m0{extra}"{data} data-id="{token}" title="{about} · '
                             f'id {token} · prompt (loss mask 0)">{shown}</span>')  # fmt: skip
                continue
            logprob = strip.logprobs[i]
            if math.isnan(logprob):
                parts.append(
                    f'<span class="t m1 nolp{extra}"{data} data-id="{token}" data-lp="nan" '
                    f'title="{about} · id {token} · no behaviour logprob">{shown}</span>'
                )
                continue
            red, green, blue = logprob_colour(logprob)
            parts.append(
                f'<span class="t m1{extra}"{data} data-id="{token}" data-lp="{logprob:.6g}" '
                f'style="background:rgb({red},{green},{blue})" title="{about} · id {token} · '
                f'logprob {logprob:.4f} (p {math.exp(logprob):.3f})">{shown}</span>'
            )
        position = hi
    if mark is not None and mark >= len(strip.ids):  # the prompt stopped short of the sample
        parts.append(f'<span class="divergence" title="{escape(strip.divergence)}"></span>')
    if position < len(strip.ids):
        parts.append(f'<span class="elided">… {len(strip.ids) - position} tokens …</span>')
    return Markup("".join(parts))
