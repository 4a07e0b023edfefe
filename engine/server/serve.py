"""The server's life: listen at once (``/health``), plan and load on a thread (a SIGTERM
or Ctrl-C meanwhile ends the process at once, exit 0), warm up (``/ready``), serve; on SIGTERM or SIGINT drain within the
grace and exit 0; a tensor-parallel rank that dies: /health 503, every request failed,
exit 1. The ``kvledger serve`` verb (``commands/serve.py``) builds its options."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from kvledger.engine.errors import DoesNotFit, KvledgerError
from kvledger.engine.frontend.served import Served
from kvledger.engine.server import listen
from kvledger.engine.server.app import build_app
from kvledger.engine.server.root_path import serve_under
from kvledger.engine.server.state import STATE, ServeOptions
from kvledger.engine.server.tls import ServerTls
from kvledger.engine.server.tls import follow as follow_tls
from kvledger.engine.slow_clients import limited_runner

log = logging.getLogger("kvledger.serve")

EXIT_RANK_LOST = 1  # a tensor-parallel rank died: the pod restarts as a whole
RANK_LOST_GRACE_S = 2.0


def _load_in_thread(config) -> asyncio.Future:
    """Plan and load on a daemon thread, so a SIGTERM during loading can still exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def load() -> None:
        try:
            from kvledger.engine.frontend.door import load_engine

            result = load_engine(config)
        except BaseException as exc:
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=load, name="kvledger-load", daemon=True).start()
    return future


def _end_while_loading() -> NoReturn:
    """End the process at once, exit 0: the load cannot be interrupted (torch's kernels, a
    process group forming), and Python finalizing under a thread inside torch's C++ aborts
    ("terminate called without an active exception", exit -6). The rank processes
    started so far are ended first (SIGTERM, which they do not handle), and a hub model's
header mirror that the plan was reading is removed."""
    import multiprocessing

    from kvledger.engine.checkpoint.hub.headers import remove_open_mirrors

    for child in multiprocessing.active_children():
        child.terminate()
    remove_open_mirrors()  # atexit does not run past os._exit
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


async def serve(config, options: ServeOptions, tls: ServerTls | None = None) -> int:
    """Serve ``config``'s model with ``options`` where they say (``--host``/``--port``, or
    ``--uds``), HTTPS with ``tls``, until stopped; the exit code."""
    app = build_app(options)
    state = app[STATE]
    runner = limited_runner(app, header_timeout_s=options.header_timeout_s,
                            write_timeout_s=options.write_timeout_s,
                            keepalive_timeout=options.keepalive_timeout_s,
                            handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    if options.root_path:
        serve_under(runner.server, options.root_path)
    try:
        where = await listen.start(runner, options.host, options.port, options.uds,
                                   tls.context if tls else None,
                                   handshake_timeout_s=options.header_timeout_s)
    except KvledgerError:
        await runner.cleanup()
        raise
    loop = asyncio.get_running_loop()
    # The first stop signal's name: Ctrl-C is SIGINT, the kubelet sends SIGTERM.
    stopped: asyncio.Future[str] = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _settle, stopped, sig.name, None)
    log.info("listening on %s; loading %s", where, config.model)
    # --enable-ssl-refresh: from now on, so a certificate renewed while loading is served.
    refresher = (asyncio.create_task(follow_tls(tls.context, tls.files))
                 if tls is not None and tls.refresh else None)
    try:
        loading = _load_in_thread(config)
        await asyncio.wait([loading, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            log.info("%s received while loading; exiting", stopped.result())
            _end_while_loading()
        try:
            engine = loading.result()
        except DoesNotFit as exc:
            print(exc.report, file=sys.stderr)
            return exc.exit_code
        await state.attach(engine)
        served, pool = state.served, state.served.pool()
        log.info("ready: serving %r on %s (context %d tokens, %d KV blocks of %d tokens)",
                 served.model_name, where, served.max_model_len, pool.num_blocks, pool.block_size)
        lost = _rank_lost(served, loop)
        followers = [task for task in (_follow_sleep_file(state, options),
                                       _follow_objectives(state)) if task is not None]
        await asyncio.wait([stopped, lost], return_when=asyncio.FIRST_COMPLETED)
        for follower in followers:
            follower.cancel()
        if lost.done():
            return await _rank_lost_exit(state, lost.result())
        log.info("%s: draining (grace %.0fs)", stopped.result(), options.shutdown_grace_s)
        await state.drain()
        return 0
    finally:
        if not stopped.done():
            stopped.cancel()
        if refresher is not None:
            refresher.cancel()
        if state.served is not None:
            state.served.stop_ranks()
        await runner.cleanup()


def _follow_sleep_file(state, options: ServeOptions) -> asyncio.Task | None:
    """With --sleep-level-file (and sleep mode on): the task acting on the file."""
    if options.sleep_level_file is None or state.door.sleep is None:
        return None
    from kvledger.engine.server import sleep_file

    return asyncio.create_task(sleep_file.follow(
        state.door.sleep, Path(options.sleep_level_file), state.metrics.sleep_state))


def _follow_objectives(state) -> asyncio.Task | None:
    """With --objectives-file: the task reading it again as the kubelet rewrites it."""
    if state.objectives.path is None:
        return None
    return asyncio.create_task(state.objectives.follow())


def _rank_lost(served: Served, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """Settled with the reason when a rank (-tp, -pp, another machine's) is lost; never
    for one rank."""
    lost = loop.create_future()
    served.on_rank_lost(lambda reason: loop.call_soon_threadsafe(_settle, lost, reason, None))
    return lost


async def _rank_lost_exit(state, reason: str) -> int:
    """A rank is gone: every request fails, /health answers 503 for
    ``RANK_LOST_GRACE_S`` (so a probe sees why), then exit ``EXIT_RANK_LOST``."""
    log.error("a rank is lost (%s): failing every request and exiting", reason)
    state.door.fail(reason)
    await asyncio.sleep(RANK_LOST_GRACE_S)
    return EXIT_RANK_LOST
