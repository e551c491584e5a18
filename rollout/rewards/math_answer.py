"""Math answers: extract the final answer of a response and decide whether it equals the label.

Extraction: the last ``\\boxed{...}`` (braces matched), else a "final answer is X" / "Answer: X" / "#### X"
phrase. Equality: normalised strings, then numbers, then HF ``math-verify`` (LaTeX parsed by an ANTLR grammar
into sympy, then compared symbolically) run in a worker process with a timeout (sympy can take unbounded time on
adversarial input; a thread cannot be stopped). Nothing a model or a data file wrote is evaluated as Python:
the parser builds expressions from a grammar, and the only ``parse_expr`` math-verify calls sees strings of
digits and arithmetic operators. The worker process is defence in depth, not the sandbox.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import re
import signal

from redline.extras import require

_FINAL_PHRASES = [re.compile(p, re.IGNORECASE) for p in (
    r"final answer is[:\s]*(.+?)(?:\.\s*$|\n|$)", r"answer\s*[:=]\s*(.+?)(?:\.\s*$|\n|$)", r"####\s*(.+?)\s*$")]


def _braced(text: str, open_at: int) -> tuple[str, int] | None:
    """Content of the brace group opening at ``text[open_at] == '{'`` and the index after it, or None."""
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1:i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``."""
    found = None
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        group = _braced(text, match.end() - 1)
        if group is not None:
            found = group[0]
    return found


def extract_answer(text: str) -> str | None:
    """The response's final answer: last boxed expression, else the last "final answer" phrase, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in _FINAL_PHRASES:
        matches = pattern.findall(text)
        if matches:
            return matches[-1].strip().strip("$").strip()
    return None


def _replace_command(text: str, command: str, render) -> str:
    """Rewrite every ``\\command{a}{b}...`` (brace groups matched) with ``render(*groups)``."""
    arity = render.__code__.co_argcount
    while (start := text.find(command + "{")) != -1:
        pos, groups = start + len(command), []
        for _ in range(arity):
            group = _braced(text, pos) if pos < len(text) and text[pos] == "{" else None
            if group is None:
                return text  # malformed; leave it for the parser to reject
            groups.append(group[0])
            pos = group[1]
        text = text[:start] + render(*groups) + text[pos:]
    return text


def normalize(answer: str) -> str:
    """Strip LaTeX presentation (``$``, ``\\left``, spacing, ``\\text``, degrees, trailing period) and spaces."""
    s = answer.strip().strip("$").strip()
    s = _replace_command(s, "\\text", lambda a: a)
    s = _replace_command(s, "\\mathrm", lambda a: a)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\dfrac", "\\frac"),
                     ("\\tfrac", "\\frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("%", ""), ("\\$", "")):
        s = s.replace(old, new)
    s = s.replace(" ", "").rstrip(".")
    return s


def _math_verify_equal(answer: str, label: str) -> bool:
    """Symbolic equality of two answers by math-verify (runs in the worker process; its own signal-based
    timeouts are off: the worker's caller enforces the timeout). Python's ``**`` is read as LaTeX's ``^``."""
    import logging

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" notice
    extraction = [LatexExtractionConfig(), ExprExtractionConfig()]

    def parsed(text: str):
        latex = text.strip().strip("$").replace("**", "^")
        return parse(f"${latex}$", extraction_config=extraction, parsing_timeout=None)

    gold, target = parsed(label), parsed(answer)
    return bool(gold and target and verify(gold, target, timeout_seconds=None))


def _as_number(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


class MathGrader:
    """Grades answers; the math-verify fallback runs in one spawned worker process, restarted after a timeout."""

    def __init__(self, timeout: float = 5.0):
        if timeout <= 0:
            raise ValueError(f"MathGrader timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self._pool = None

    def _worker(self):
        if self._pool is None:
            require("math_verify", "the math reward")
            # Ctrl-C at the terminal reaches the worker too; the run stops it when it stops (close)
            self._pool = multiprocessing.get_context("spawn").Pool(processes=1, initializer=signal.signal,
                                                                   initargs=(signal.SIGINT, signal.SIG_IGN))
        return self._pool

    async def equal(self, answer: str, label: str) -> bool:
        """True when ``answer`` and ``label`` are the same value; False on a timeout of the symbolic check."""
        a, b = normalize(answer), normalize(str(label))
        if a == b:
            return True
        x, y = _as_number(a), _as_number(b)
        if x is not None and y is not None:
            return abs(x - y) <= 1e-6 * max(1.0, abs(y))
        pending = self._worker().apply_async(_math_verify_equal, (answer, str(label)))
        try:
            return await asyncio.to_thread(pending.get, self.timeout)
        except multiprocessing.TimeoutError:
            self.close()  # the worker is stuck in sympy; a fresh one serves the next call
            return False

    async def score(self, response: str, label) -> float:
        """1.0 when the response's extracted final answer equals ``label``, else 0.0 (also when none is found)."""
        answer = extract_answer(response)
        return float(answer is not None and await self.equal(answer, label))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None
