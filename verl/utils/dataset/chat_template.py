"""Render a dataset's prompts through a chat template that may be hostile, with its time and memory bounded.

A chat template is code from outside the package (``actor_rollout_ref.model.custom_chat_template`` or the model
folder's tokenizer files). transformers renders it in jinja's immutable sandbox, which stops attribute escapes
and ``raise_exception`` with an exception but bounds neither time (two nested ``range(100000)`` loops run 10^10
iterations) nor memory (``'x' * 10**10``). So the prompts are rendered in a forked child process:

- time: the parent waits at most ``SECONDS_PER_PROMPT`` for each rendered prompt and kills the child when one
  does not come. A wall-clock watchdog outside the renderer is the only bound that also holds inside a single
  long C call (a string repeat, a regex), where a ``sys.settrace`` or ``SIGALRM`` limit in the same process is
  never reached; a process is also the only thing that can be stopped without cooperation.
- memory: the child's address space is capped at its size when forked plus ``MEMORY_BYTES`` (``RLIMIT_AS``,
  never above the hard limit the driver was given), so an allocation past it raises MemoryError in the child,
  not the OOM killer in the driver.
- size: a rendered prompt longer than ``max_chars`` is sent back as its two ends only (with its length), so
  the parent never holds or tokenizes more than the length rule can use (``verl.utils.dataset.rl_dataset``).

Forking (not spawning) lets the child reuse the parsed rows and the tokenizer without copying or re-importing
them; it only runs the jinja renderer, never torch or the tokenizer's Rust code. The child dies with the driver
(``verl.utils.process_lifetime``): a killed driver leaves no renderer behind, stuck on a full pipe. It closes
the pipe's other end, and the checkpoint directory's writer lock is closed in every fork
(``verl.utils.checkpoint.dir_lock``). Any failure comes back as one line naming the template's source and
the row: ``TemplateError``.
"""

from __future__ import annotations

import multiprocessing
import resource
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl.utils import process_lifetime
from verl.utils.one_line import one_line

SECONDS_PER_PROMPT = 5.0  # a real template renders a prompt in well under 10 ms
MEMORY_BYTES = 1 << 30


class TemplateError(ValueError):
    """The chat template failed, ran too long or took too much memory; one line naming its source and the row."""


@dataclass
class Rendered:
    """One prompt as rendered: ``text`` whole, or (``length`` > the caller's ``max_chars``) only its first and
    last ``max_chars`` characters in ``head`` and ``tail``."""

    length: int
    text: str | None = None
    head: str = ""
    tail: str = ""

    @classmethod
    def of(cls, text: str, max_chars: int) -> Rendered:
        """``text`` whole when it has at most ``max_chars`` characters, else its length and its two ends."""
        return cls(len(text), text) if len(text) <= max_chars else cls(len(text), None, text[:max_chars], text[-max_chars:])


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[0]) * resource.getpagesize()


def _cap_memory() -> None:
    """Cap this process's address space at its size plus MEMORY_BYTES, or at the hard limit it was started
    with when that is lower (``ulimit -v``, a batch scheduler's ``h_vmem``): a soft limit may not exceed it."""
    limit = _address_space_bytes() + MEMORY_BYTES
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _rejects_the_row(exc: Exception) -> bool:
    """Whether the template itself refused the row (its ``raise_exception``, which raises jinja's plain
    TemplateError): the row may be what is wrong, not the template."""
    from jinja2.exceptions import TemplateError as JinjaTemplateError

    return type(exc) is JinjaTemplateError


def _render_all(
    parent: tuple[int, bool], tokenizer: Any, prompts: Sequence[Any], template_kwargs: Mapping[str, Any], max_chars: int, parents_end: Any, conn: Any
) -> None:
    """The child: render each prompt in order, send each result (or the first failure) through ``conn``."""
    process_lifetime.die_with(*parent)
    parents_end.close()
    try:
        _cap_memory()
    except (OSError, ValueError) as exc:
        conn.send(("error", 0, f"its memory could not be capped ({type(exc).__name__}: {one_line(exc, 300)})"))
        return
    for index, messages in enumerate(prompts):
        try:
            text = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=False, **template_kwargs)
            if not isinstance(text, str):
                raise TypeError(f"rendered a {type(text).__name__}, not text")
            rendered = Rendered.of(text, max_chars)
        except MemoryError:
            conn.send(("error", index, f"it needed more than {MEMORY_BYTES >> 20} MiB of memory"))
            return
        except Exception as exc:  # noqa: BLE001 - whatever the template raises is the template's failure
            status = "rejected" if _rejects_the_row(exc) else "error"
            conn.send((status, index, f"{type(exc).__name__}: {one_line(exc, 300)}"))
            return
        conn.send(("ok", index, rendered))
    conn.close()


def render_prompts(
    tokenizer: Any, prompts: Sequence[Any], template_kwargs: Mapping[str, Any], max_chars: int, source: str, where: str
) -> Iterator[Rendered]:
    """Each prompt (a list of chat messages) rendered by ``tokenizer``'s chat template in a bounded child process.

    ``source`` names the template (a config key or a tokenizer file), ``where`` the data (``data.train_files``);
    a failure raises TemplateError naming both and the row.
    """
    if not prompts:
        return
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    args = (process_lifetime.starter(), tokenizer, prompts, dict(template_kwargs), max_chars, receiver, sender)
    child = context.Process(target=_render_all, args=args, daemon=True)
    try:
        try:
            child.start()
        except OSError as exc:
            raise TemplateError(f"{source}: cannot start the chat template's renderer ({exc.strerror or exc}); free memory or processes and run again") from None
        finally:
            sender.close()
        for index in range(len(prompts)):
            if not receiver.poll(SECONDS_PER_PROMPT):
                raise TemplateError(
                    f"{source}: the chat template ran more than {SECONDS_PER_PROMPT:.0f} s on {where} row {index} and was "
                    "stopped (a loop without end?); fix the template"
                )
            try:
                status, _, value = receiver.recv()
            except EOFError:
                child.join(5)
                raise TemplateError(f"{source}: the chat template's renderer died on {where} row {index} (exit code {child.exitcode}); fix the template") from None
            if status != "ok":
                fix = "fix the template or the row" if status == "rejected" else "fix the template"
                raise TemplateError(f"{source}: the chat template failed on {where} row {index} ({value}); {fix}")
            yield value
    finally:
        receiver.close()
        if child.pid is not None:  # started
            if child.is_alive():
                child.kill()
            child.join()
