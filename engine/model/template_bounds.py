"""What a request's own chat template may cost (``--trust-request-chat-template``).

A template is a program: jinja2's sandbox keeps it from the server's files and objects,
not from its time or memory. A 167-byte request (two nested loops) held the server's
event loop 10.5 s, and ``{{ 'x' * 50000000 }}`` took 26 s and 1.6 GB before the prompt
was found too long. A request's template therefore renders on a worker thread (the
server's choice) within ``RENDER_SECONDS``, its text at most ``MAX_RENDERED_CHARS``, and
its ``*`` and ``**`` may not build a value past those bounds in one operation; any of
them is a 400. The model's own templates are the deployment's and are not bounded.

What this does not bound: memory grown step by step within the deadline (a string
doubled in a loop); the flag still trusts the clients it is given to with that.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from kvledger.engine.errors import BadInput

RENDER_SECONDS = 2.0  # a model's template renders 2,048 messages in well under 0.1 s
MAX_RENDERED_CHARS = 4 << 20  # a prompt no longer than a request body may be
MAX_EXPONENT = 1024


class TemplateTooCostly(BadInput):
    """A request's chat template ran past its time or size bound."""


def untrusted_environment(**options: Any):
    """jinja2's immutable sandbox whose ``*`` and ``**`` refuse a value past the bounds."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for items, times in ((left, right), (right, left)):
                    if (isinstance(items, str | list | tuple) and isinstance(times, int)
                            and len(items) * times > MAX_RENDERED_CHARS):
                        raise TemplateTooCostly(
                            f"the request's chat template builds a value of more than "
                            f"{MAX_RENDERED_CHARS} items")
            elif isinstance(right, int) and abs(right) > MAX_EXPONENT:
                raise TemplateTooCostly(f"the request's chat template raises to a power "
                                        f"above {MAX_EXPONENT}")
            return super().call_binop(context, operator, left, right)

    return BoundedSandbox(**options)


def render_bounded(template: Any, context: dict[str, Any]) -> str:
    """``template`` rendered with ``context`` within ``RENDER_SECONDS`` (checked at every
    line it runs, loops that write nothing included) and ``MAX_RENDERED_CHARS``."""
    deadline = time.monotonic() + RENDER_SECONDS

    def check(frame, event, arg):  # every call and line of this thread while it renders
        if time.monotonic() > deadline:
            raise TemplateTooCostly(f"the request's chat template ran longer than "
                                    f"{RENDER_SECONDS:g} s")
        return check

    previous = sys.gettrace()
    sys.settrace(check)
    try:
        parts, size = [], 0
        for part in template.generate(context):
            size += len(part)
            if size > MAX_RENDERED_CHARS:
                raise TemplateTooCostly(f"the request's chat template renders more than "
                                        f"{MAX_RENDERED_CHARS} characters")
            parts.append(part)
        return "".join(parts)
    finally:
        sys.settrace(previous)
