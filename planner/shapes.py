"""What a model's input batch is, read by its role. Standard library only: probes read it, the planner uses it.

A loop rentplan does not run (`--script`, callbacks) states no shape; the model call's tensors are read by role:
- token ids, an integer N×L tensor: batch N, sequence L ("tokens 8×512");
- a float image batch N×C×H×W (or a volume N×C×D×H×W): batch N, positions H×W (D×H×W); the channels are no
  sequence ("image 8×3×32×32");
- any other float N×L×D (embeddings, audio frames): batch N, sequence L ("sequence 8×100×80");
- a float N×D (one feature vector per example): batch N, one position ("features 8×64").
A line's `seq_len` is the positions per example (what activations grow with); `input_shape` keeps what was read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

KINDS = ("tokens", "image", "sequence", "features")
# Kinds whose positions are fixed by the data, not a length to extrapolate along: a campaign must name one the
# runs read (planner/decisions/shapes.py).
FIXED = ("image", "features")


@dataclass(frozen=True)
class InputShape:
    kind: str  # one of KINDS
    dims: tuple[int, ...]  # the tensor's shape as read, batch first

    @property
    def batch(self) -> int:
        return self.dims[0]

    @property
    def spatial(self) -> tuple[int, ...]:
        """An image's H×W (a volume's D×H×W); the sequence's L; nothing for features."""
        if self.kind == "image":
            return self.dims[2:]
        return self.dims[1:2] if self.kind in ("tokens", "sequence") else ()

    @property
    def positions(self) -> int:
        return math.prod(self.spatial)

    @property
    def text(self) -> str:
        return f"{self.kind} " + "×".join(str(d) for d in self.dims)

    @property
    def positions_text(self) -> str:
        """'1,024 positions (32×32)' for an image; 'seq_len 512' for a sequence."""
        if self.kind == "image":
            return f"{self.positions:,} positions ({'×'.join(str(d) for d in self.spatial)})"
        return f"seq_len {self.positions}" if self.kind != "features" else "one position (a feature vector)"


def read_shape(dims, floating: bool) -> InputShape | None:
    """The role of a tensor of shape `dims` (None below two dimensions: a label, a timestep)."""
    dims = tuple(int(d) for d in dims)
    if len(dims) < 2:
        return None
    if not floating:
        return InputShape("tokens", dims[:2])
    if len(dims) in (4, 5):
        return InputShape("image", dims)
    if len(dims) == 2:
        return InputShape("features", dims)
    return InputShape("sequence", dims[:3])


_TEXT = re.compile(r"(\w+) (\d+(?:×\d+)+)")


def parse_shape(text) -> InputShape | None:
    """A ledger's input_shape text back as the shape (None: not read, as on older lines and rentplan's probes)."""
    m = _TEXT.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None or m.group(1) not in KINDS:
        return None
    return InputShape(m.group(1), tuple(int(d) for d in m.group(2).split("×")))


def dimension_words(kind: str) -> dict:
    """How a sheet names the per-example dimension of a campaign whose inputs are `kind`: an image has positions
    (H×W), no sequence; a feature vector has neither, so its max-dimension column is left out."""
    if kind == "image":
        return {"unit": "positions", "header": "max positions", "column": "max_positions", "shown": True}
    if kind == "features":
        return {"unit": "positions", "header": "", "column": "", "shown": False}
    return {"unit": "seq_len", "header": "max seq", "column": "max_seq", "shown": True}


def size_text(kind: str, n: int, read: InputShape | None = None, per_example: bool = False) -> str:
    """A campaign's per-example size in its kind's words: 'seq_len 512'; an image's '1,024 positions (32×32)'
    (the sides where a run read that size)."""
    if kind not in FIXED:
        return f"seq_len {n}"
    text = read.positions_text if read is not None and read.positions == n else f"{n:,} positions"
    return text + (" per example" if per_example else "")
