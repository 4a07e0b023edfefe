"""``LLM``'s runs through the door's line, stepping the engine in the caller's thread.

Each prompt (checked at the door: ``FrontDoor.prepare``) lines up in the door's own
admission line, in order, with no cap on the line nor on the wait; each is handed to the
engine as its reservation is granted, and the line moves on after every step (finished
requests gave their blocks back; over-committing, running ones drew theirs). The server
awaits ``Admission.admit`` on its event loop; here grants arrive in plain futures, since
this loop steps the engine itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from kvledger.engine.admission.line import Admission
from kvledger.engine.admission.ticket import Ticket
from kvledger.engine.core.outputs import RequestOutput
from kvledger.engine.frontend.submission import PromptRun

if TYPE_CHECKING:
    from kvledger.engine.core.engine import LLMEngine


def run_to_end(engine: LLMEngine, admission: Admission, runs: dict[str, PromptRun],
               on_finished: Callable[[RequestOutput], None] | None = None
               ) -> dict[str, RequestOutput]:
    """Every run's final output, by request id (``on_finished`` told of each as it
    finishes: ``LLM``'s progress bar). On any failure (Ctrl-C, a failed step) every block
    goes back before it is raised."""
    line: dict[str, tuple[PromptRun, Future[Ticket]]] = {}
    granted_ids: deque[str] = deque()  # in the order the line granted them
    finished: dict[str, RequestOutput] = {}
    try:
        for request_id, run in runs.items():
            granted: Future[Ticket] = Future()
            granted.add_done_callback(lambda _, rid=request_id: granted_ids.append(rid))
            line[request_id] = (run, granted)
            request = run.choices[0]
            admission.line_up(request_id, len(run.prompt_ids), request.cap_tokens, granted,
                              prompt_token_ids=run.prompt_ids,
                              use_cached=request.uses_cached_blocks, salt=request.lora_salt,
                              adapter=request.lora, tenant=request.tenant,
                              priority=request.priority)
        while line or engine.has_unfinished_requests():
            while granted_ids:  # handed over as granted, whatever their order in the list
                request_id = granted_ids.popleft()
                run, granted = line.pop(request_id)
                run.ticket = granted.result()
                run.handed = 1
                engine.add_request(request_id, run.choices[0],
                                   reservation=run.ticket.reservation)
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    admission.done(runs[out.request_id].ticket)
                    if on_finished is not None:
                        on_finished(out)
            # Over-committing, the ledger's verdict on the head moves as requests write.
            admission.capacity_changed()
    except BaseException:
        engine.abort_all()
        for _, granted in line.values():
            if granted.done():  # granted, never handed to the engine
                admission.give_back(granted.result().reservations)
        raise
    return finished
