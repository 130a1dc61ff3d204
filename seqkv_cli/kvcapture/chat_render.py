"""A model's chat template rendered with bounds: the template is code from the model's files.

transformers renders a chat template in a jinja sandbox (no attribute escapes), but with no
bound on what it makes: a template can render 2**34 characters, or multiply a string that
big in one step, and any error it raises is a traceback. Here the same template is
rendered with transformers' own jinja environment (its filters, globals and options: the
text is character for character what `apply_chat_template` gives) in a sandbox that
also refuses, in one line, an output past `MAX_OUTPUT_CHARS`, a string or list operation
that would make one, any number argument past it (``center(10**10)``, ``batch(...)``), and a
render running past `MAX_SECONDS`.
"""

from __future__ import annotations

import contextlib
import functools
import re
import signal
import threading
import time

from seqkv_cli.errors import SeqkvError

MAX_OUTPUT_CHARS = 1 << 24  # 16 Mi characters: more than any context's worth of text
MAX_SECONDS = 10.0
_BIG_WIDTH = re.compile(rf"\d{{{len(str(MAX_OUTPUT_CHARS))},}}")  # "%0999999999d", "{:>9999...}"


class _Refused(Exception):
    """A bound crossed inside the template (raised through jinja, refused outside)."""


_state = threading.local()


def _check_time() -> None:
    deadline = getattr(_state, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise _Refused(f"rendering took more than {MAX_SECONDS:g} s")


def _size(value) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple) else 0


def _check_args(args, kwargs) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_OUTPUT_CHARS:
            raise _Refused(f"a number argument of {a:,} (more than {MAX_OUTPUT_CHARS:,})")
        if _size(a) > MAX_OUTPUT_CHARS:
            raise _Refused(f"a value of more than {MAX_OUTPUT_CHARS:,} characters")


@functools.lru_cache(maxsize=1)
def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers.utils.chat_template_utils import _compile_jinja_template

    base = _compile_jinja_template("").environment  # transformers' own filters and globals

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def call_binop(self, context, operator, left, right):
            _check_time()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if _size(seq) and isinstance(n, int) and _size(seq) * n > MAX_OUTPUT_CHARS:
                        raise _Refused(f"a repetition of more than {MAX_OUTPUT_CHARS:,} items")
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and abs(right) > 4096:
                    raise _Refused(f"a power of exponent {right:,}")
            elif operator == "%" and isinstance(left, str) and _BIG_WIDTH.search(left):
                raise _Refused("a format width past the output limit")
            elif operator == "+" and _size(left) + _size(right) > MAX_OUTPUT_CHARS:
                raise _Refused(f"a value of more than {MAX_OUTPUT_CHARS:,} characters")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):
            _check_time()
            _check_args(args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):
            bound_to = getattr(value, "__self__", None)
            if isinstance(bound_to, str) and _BIG_WIDTH.search(bound_to):
                raise _Refused("a format width past the output limit")
            return super().wrap_str_format(value)

    class Namespace(base.globals["namespace"]):
        """transformers' namespace, whose values are bounded: ``{% set ns.s = ns.s ~ ns.s %}``
        in a loop doubles a string with no operator or call to check."""

        def __setitem__(self, name, value):
            _check_time()
            if _size(value) > MAX_OUTPUT_CHARS:
                raise _Refused(f"a value of more than {MAX_OUTPUT_CHARS:,} characters")
            super().__setitem__(name, value)

    env = Bounded(
        trim_blocks=base.trim_blocks,
        lstrip_blocks=base.lstrip_blocks,
        extensions=[type(e) for e in base.extensions.values()],
    )
    env.globals.update(base.globals)  # its range is the sandbox's bounded one
    env.globals["namespace"] = Namespace
    env.filters.update({name: _bounded_filter(f) for name, f in base.filters.items()})
    return env


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """A template compiled once (a dataset renders the same one for every session)."""
    return _environment().from_string(template)


def _bounded_filter(f):
    """A filter whose number arguments (after the value filtered) are bounded."""

    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        _check_time()
        for a in (*args[1:], *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_OUTPUT_CHARS:
                raise _Refused(f"a number argument of {a:,} (more than {MAX_OUTPUT_CHARS:,})")
        return f(*args, **kwargs)

    return bounded


def chosen_template(tok) -> str | None:
    """The tokenizer's chat template: its one template, or of named ones (tokenizer_config's
    [{"name": ..., "template": ...}] layout) the "default", else the first."""
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):
        if not template:
            return None
        template = template.get("default", next(iter(template.values())))
    return template if isinstance(template, str) and template else None


@contextlib.contextmanager
def _alarm(seconds: float):
    """A timer for templates that loop without calling or writing anything (where the
    checks above never run); the main thread only, the previous handler put back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise _Refused(f"rendering took more than {MAX_SECONDS:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def render_chat(tok, messages: list[dict], source: str) -> str:
    """``tok.apply_chat_template(messages, tokenize=False)``, bounded; refused in one line
    naming ``source`` (the session) where the template fails or crosses a bound."""
    template = chosen_template(tok)
    if template is None:
        raise SeqkvError(f"{source}: the model's tokenizer has no chat template")
    kwargs = dict(getattr(tok, "special_tokens_map", None) or {})
    parts: list[str] = []
    total = 0
    _state.deadline = time.monotonic() + MAX_SECONDS
    try:
        with _alarm(MAX_SECONDS + 1):
            compiled = _compiled(template)
            for part in compiled.generate(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=False,
                **kwargs,
            ):
                total += len(part)
                if total > MAX_OUTPUT_CHARS:
                    raise _Refused(f"its output exceeds {MAX_OUTPUT_CHARS:,} characters")
                _check_time()
                parts.append(part)
    except _Refused as exc:
        raise SeqkvError(f"{source}: the model's chat template was stopped: {exc}") from None
    except RecursionError:
        raise SeqkvError(f"{source}: the model's chat template recursed too deeply") from None
    except MemoryError:
        raise SeqkvError(f"{source}: the model's chat template ran out of memory") from None
    except Exception as exc:  # its own raise_exception, syntax, sandbox refusals, type errors
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise SeqkvError(f"{source}: the model's chat template failed: {line}") from None
    finally:
        _state.deadline = None
    return "".join(parts)
