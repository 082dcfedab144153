"""The engine protocol: batch in, batch out, one thread owns it.

An engine turns a list of requests that can share a forward pass into a list of outputs, one per
request, in order. A failed item comes back as an exception *in its slot*, so it fails only its own
job; an exception raised by ``synthesize_batch`` itself means the whole batch failed, and the batcher
then retries the items one by one to find the culprit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from ttsq.config import Settings
    from ttsq.keys import EngineIdentity
    from ttsq.request import SynthesisRequest


@dataclass(frozen=True)
class EngineOutput:
    """Audio for one request."""

    samples: npt.NDArray[np.float32] | npt.NDArray[np.int16]
    sample_rate: int
    #: Hit the frame cap without an end token.
    truncated: bool = False
    #: Request fields this engine could not honour.
    ignored: tuple[str, ...] = field(default=())


class Engine(Protocol):
    """A speech model behind the batcher. Every method is called from the batcher thread only."""

    identity: EngineIdentity

    def load(self) -> None:
        """Load weights; called once, before the worker consumes."""
        ...

    def warmup(self) -> None:
        """Run a tiny synthesis so the first real job pays no first-call costs."""
        ...

    def synthesize_batch(self, requests: Sequence[SynthesisRequest]) -> list[EngineOutput | Exception]:
        """One output or exception per request, in order."""
        ...

    def close(self) -> None:
        """Release the model."""
        ...


class EngineFactory(Protocol):
    def __call__(self, settings: Settings) -> Engine: ...
