"""A reservation: one request's claim on the KV pool, which the ledger (``ledger.py``)
grants, grows and releases, under its lock; the engine only reads it (its blocks, where
its prefill starts).

With prefix caching a reservation is two things: the cached blocks it pinned (its *hits*:
the longest run of the prompt's full blocks already registered, found at admission and
again as its request starts) and a count of blocks it may still *draw*
(``blocks_for(prompt + cap) - hits``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvledger.engine.kv.block_pool import BlockHash, BlockPool, Salt


class PromptShare:
    """The choices of one request (``n > 1``) share the full blocks of their prompt past
    the cached hits, ``[start, end)``: the ``owner`` draws and computes them, the others
    (``waiting``) pin them once computed (``share_prompt``) and never claim them. If the
    owner is released before that, the first waiting one becomes the owner, and its
    claim grows by the blocks it must now compute itself."""

    __slots__ = ("end", "owner", "start", "waiting")

    def __init__(self, owner: Reservation, waiting: list[Reservation], start: int, end: int) -> None:
        self.owner, self.waiting, self.start, self.end = owner, waiting, start, end

    @classmethod
    def begin(cls, reservations: list[Reservation], start: int, end: int) -> None:
        """The first of ``reservations`` computes blocks ``[start, end)``, the others will
        pin them: their claims shrink by as many."""
        share = cls(reservations[0], reservations[1:], start, end)
        for reservation in reservations:
            reservation.share = share
        for reservation in share.waiting:
            reservation.draws_left -= end - start

    def hand_out(self, pool: BlockPool, block_size: int,
                 may_share: Callable[[Reservation, list[int]], bool] | None = None
                 ) -> list[Reservation]:
        """The owner has computed the shared blocks: pin them for the waiting choices,
        which then start after them. Returns those choices; one ``may_share`` refuses
        (``--admission safe``) leaves the share and will draw and compute its own, its
        claim grown by as many. Under the ledger's lock."""
        blocks = self.owner.block_ids[self.start:self.end]
        if self.waiting and len(blocks) != self.end - self.start:
            raise RuntimeError("share_prompt() before the owner drew its prompt")  # engine bug
        handed = []
        while self.waiting:  # the others still count as awaiting while one is checked
            reservation = self.waiting.pop(0)
            if may_share is not None and not may_share(reservation, blocks):
                reservation.share = None
                reservation.draws_left += len(blocks)
                continue
            for block in blocks:
                pool.pin(block)
            reservation.block_ids.extend(blocks)
            reservation.num_cached_blocks = reservation.num_registered_blocks = self.end
            reservation.num_cached_tokens = self.end * block_size
            handed.append(reservation)
        return handed

    def leave(self, reservation: Reservation) -> int:
        """``reservation`` is released: an owner hands its claim on the shared blocks to
        the first choice still waiting. Returns the draws that adds to the ledger's
        outstanding. Under the ledger's lock."""
        if not self.waiting:
            return 0
        if self.owner is not reservation:
            self.waiting.remove(reservation)
            return 0
        self.owner = heir = self.waiting.pop(0)
        heir.draws_left += self.end - self.start
        return self.end - self.start


class Reservation:
    """A claim on ``num_blocks`` blocks: ``block_ids`` holds the pinned hits
    (``num_cached_blocks``, first) and the blocks drawn so far; ``draws_left`` more may be
    drawn. ``block_hashes`` are the keys of its first full blocks known so far. ``share``:
    the ``PromptShare`` of its request's choices, if they share their prompt. ``adapter``:
    its request's LoRA adapter (None: the base model), which takes one of the engine's
    adapter slots (one per adapter object) while it is ``seated`` (scheduled: ``KVLedger.seat``)."""

    __slots__ = (
        "adapter",
        "block_hashes",
        "block_ids",
        "draws_left",
        "event_keys",
        "num_blocks",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_registered_blocks",
        "prompt_token_ids",
        "released",
        "root",
        "salt",
        "seated",
        "share",
    )

    def __init__(self, num_blocks: int, hits: list[int], block_size: int,
                 block_hashes: list[BlockHash], prompt_token_ids: Sequence[int] | None,
                 root: BlockHash | None = None, adapter: object | None = None,
                 salt: Salt | str | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_ids = list(hits)
        self.num_cached_blocks = len(hits)
        self.num_cached_tokens = len(hits) * block_size  # the sequence starts its prefill here
        self.draws_left = num_blocks - len(hits)
        self.block_hashes = list(block_hashes)
        self.num_registered_blocks = len(hits)  # blocks before this one need no register()
        # The prompt the cache was consulted for (its keys made of): None when it was not.
        self.prompt_token_ids = prompt_token_ids
        self.root = root  # the parent key of its first block: its cache salt (None: none)
        self.salt = salt if isinstance(salt, Salt) else None  # its client's part: KV events
        self.event_keys: list[bytes] = []  # vLLM's keys of its blocks, with KV events on
        self.share: PromptShare | None = None
        self.adapter = adapter
        self.seated = False
        self.released = False

    @property
    def awaits_share(self) -> bool:
        """Its prompt's shared blocks are still to be computed by another choice."""
        return self.share is not None and self in self.share.waiting

    @property
    def awaited_blocks(self) -> int:
        """The shared blocks it will pin rather than draw (0 once pinned, or for the owner):
        ``len(block_ids) + draws_left + awaited_blocks == num_blocks``."""
        return self.share.end - self.share.start if self.awaits_share else 0

    @property
    def used_blocks(self) -> int:
        return len(self.block_ids)

    def __repr__(self) -> str:
        if self.released:
            return "Reservation(released)"
        return (f"Reservation({self.used_blocks}/{self.num_blocks} used, "
                f"{self.num_cached_blocks} cached)")
