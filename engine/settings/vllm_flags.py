"""Every ``vllm serve`` flag kvledger does not define itself, and what it does here.

A vLLM launch line must port as it is: each of vLLM's flags is kvledger's own (same name,
same behaviour: ``engine/settings/*_config.py``, ``engine/server/serve.py``), accepted because it
changes nothing here (the reason is in ``--help``), or refused by name with one line and
exit 2 saying why; never argparse's ``unrecognized arguments``. ``RULES``
(``vllm_rules.py``) is the one owner of the last two, and of the flags read here rather
than defined (``--config``, ``-O``, ``--compilation-config``, ``--revision``); a vLLM flag
without a rule is refused as unsupported.

``VLLM_SERVE_FLAGS`` (``vllm_serve_flags.py``) lists vLLM's flags, read from its source.
"""

from __future__ import annotations

import argparse

from kvledger.engine.errors import BadInput
from kvledger.engine.settings.vllm_rule import Rule, refusal
from kvledger.engine.settings.vllm_rules import RULES
from kvledger.engine.settings.vllm_serve_flags import VLLM_SERVE_FLAGS

__all__ = ["RULES", "VLLM_SERVE_FLAGS", "Rule", "add_vllm_flags", "refusal", "verdicts",
           "vllm_dest"]


class _VllmFlag(argparse.Action):
    """Accepts a no-op flag (and stores nothing), keeps a read one's value, or raises
    BadInput for a refused one."""

    def __init__(self, option_strings, dest, rule: Rule | None = None, **kwargs) -> None:
        self.rule = rule
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = [] if values is None else [values] if isinstance(values, str) else list(values)
        rule = self.rule
        if rule is None or rule.refused_always:
            raise BadInput(refusal(option_string, given, rule))
        if rule.accepts and not set(given) <= rule.accepts:
            raise BadInput(refusal(option_string, given, rule))
        if rule.read and rule.parse is not None:
            setattr(namespace, self.dest, given[0])  # parsed by argparse (its type)


def _help(rule: Rule | None) -> str:
    if rule is None or rule.refused_always:
        return argparse.SUPPRESS
    if rule.accepts:
        return (f"vLLM's; {' or '.join(sorted(rule.accepts))} changes nothing ({rule.why}); "
                f"anything else is refused")
    if rule.read:
        return f"vLLM's: {rule.why}"
    return f"vLLM's; accepted, changes nothing: {rule.why}"


def _forms(action: str) -> list[list[str]]:
    """One vLLM action's option strings, split into its flag (and aliases) and its --no- form."""
    flags = action.split()
    on = [f for f in flags if not f.startswith("--no-")]
    off = [f for f in flags if f.startswith("--no-")]
    return [form for form in (on, off) if form]


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Every vLLM flag the parser does not define yet, ruled by RULES; call it last, after a
    command's own flags, so those stay its own (``serve``'s ``--host`` serves, ``plan``'s
    is a no-op)."""
    group = parser.add_argument_group(
        "vLLM's other flags", "accepted where they change nothing here (below); every other "
        "`vllm serve` flag is refused by name, one error line, exit 2 (engine/settings/vllm_rules.py)")
    taken = parser._option_string_actions  # argparse's own registry of defined flags
    for action in VLLM_SERVE_FLAGS:
        for form in _forms(action):
            form = [f for f in form if f not in taken]
            if not form:
                continue
            rule = RULES.get(form[0])
            if rule is None and form[0].startswith("--no-"):
                rule = RULES.get("--" + form[0][5:])
            refused = rule is None or rule.refused_always
            nargs = "*" if refused else rule.nargs
            metavar = "VALUE" if nargs not in (0, "*") else None
            checked = {} if refused else {"type": rule.parse, "choices": rule.choices}
            group.add_argument(*form, action=_VllmFlag, rule=rule, nargs=nargs,
                               dest=vllm_dest(form[0]), default=argparse.SUPPRESS,
                               metavar=metavar, help=_help(rule), **checked)


def vllm_dest(flag: str) -> str:
    """Where a read vLLM flag's value is kept in the namespace: ``_vllm_<flag>``."""
    return "_vllm_" + flag.lstrip("-").replace("-", "_")


def verdicts(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each of vLLM's flags (its first spelling) as ``parser`` takes it: ``implemented``
    (the command's own flag, or read), ``no-op`` or ``refused``."""
    actions = parser._option_string_actions
    out = {}
    for spelled in VLLM_SERVE_FLAGS:
        flag = _forms(spelled)[0][0]
        action = actions[flag]
        if not isinstance(action, _VllmFlag):
            out[flag] = "implemented"
        elif action.rule is None or action.rule.refused_always:
            out[flag] = "refused"
        else:
            out[flag] = "implemented" if action.rule.read else "no-op"
    return out
