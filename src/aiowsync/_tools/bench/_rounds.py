"""A cell's rounds: every contender's samples taken in turn, per gate, in an order shuffled
anew each time."""

from __future__ import annotations

import gc
import random
from typing import Protocol

from ._contenders import Contender
from ._probe import QUIET_AGAIN_S, QUIET_MOST_S

__all__ = ["ROUND_START", "Say", "rounds"]


class Say(Protocol):
    """Where the rounds report their progress (:class:`~aiowsync._tools.bench._run.Progress`)."""

    def say(self, text: str, force: bool = True) -> None: ...


async def rounds(
    everyone: list[Contender],
    samples: int,
    progress: Say,
    label: str,
    paired: bool,
    gates: tuple[str, ...] = ("quiet",),
) -> None:
    """``samples`` rounds; in each, for each of ``gates`` in turn, every contender's turn
    once, in an order shuffled anew every time (seeded by ``label``, so a cell's orders are
    the same in every run).

    A rotating order changed only who went first: every contender followed the same one in
    every round, so whatever one turn left behind (TorchRL's MultiProcess ``send()`` of the
    1000-tensor model is seconds of many busy processes) fell on the same next contender
    (docs/adr/0018). Shuffled, each contender follows each other one about equally often;
    ``Contender.after`` (``busy_after``) records, sample by sample, whose turn came just
    before.

    Under the ``"quiet"`` gate each sample's timed part starts once no other task of the
    machine is running or ready to run (:func:`~aiowsync._tools.bench._probe.wait_quiet`).
    TorchRL's trees of the 1000-tensor model keep their processes busy for a while after
    their ``send()`` returns, and whichever contender came next paid for it (docs/adr/0050).
    The wait takes away what other processes leave running, not whatever else slows a copy.
    Waits are usually a few milliseconds; after one that gave up, the next waits at most
    :data:`~aiowsync._tools.bench._probe.QUIET_AGAIN_S`. Under the ``"busy"`` gate the
    timed part starts at once, on the machine as the turn before left it (the workers of the
    policy profile may still be reading the last version): what a trainer that sends
    whenever its step ends sees. Its samples go to ``Contender.busy``.

    Before each round the garbage is collected (untimed), so that a collection never lands
    inside a sample; what exists before the first round (torch, the sessions, the trees) is
    frozen out of those collections: a full collection walks every object of the heap and
    slows the small sends right after it.
    """
    rng = random.Random(label)
    most = QUIET_MOST_S
    gc.collect()
    gc.freeze()
    try:
        for r in range(samples):
            gc.collect()  # only what the rounds made since
            before = ROUND_START
            for gate in gates:
                order = list(everyone)
                rng.shuffle(order)
                for c in order:
                    if gate == "busy":
                        c.busy_after.append(before)
                        if paired:  # two sends back to back, neither waits
                            c.busy_lead.append(await c.sample())
                        c.busy.append(await c.sample())
                    else:
                        c.after.append(before)
                        if paired:  # two sends back to back; the wait comes before the first
                            c.samples_lead.append(await c.sample_when_quiet(most))
                            c.samples.append(await c.sample())
                        else:
                            c.samples.append(await c.sample_when_quiet(most))
                        most = QUIET_MOST_S if c.quiet[-1][1] else QUIET_AGAIN_S
                    before = c.name
            last = " | ".join(f"{c.name} {(c.samples or c.busy)[-1] * 1e3:.1f}" for c in everyone)
            progress.say(f"{label}: round {r + 1}/{samples} ms: {last}", force=False)
    finally:
        gc.unfreeze()


ROUND_START = "(round start)"
"""What :attr:`Contender.after` records for the first turn of a round (after the untimed
garbage collection)."""
