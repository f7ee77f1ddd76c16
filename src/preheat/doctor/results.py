"""What a check returns (``CheckResult``), what doctor returns (``Report``), and the ``Check`` a
check module registers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from preheat.doctor.context import Context

OK, WARN, FAIL = "ok", "warn", "fail"
_STATUS_ORDER = {OK: 0, WARN: 1, FAIL: 2}


@dataclass
class CheckResult:
    """One check: ``status`` is ok/warn/fail; ``fix`` is set whenever status is not ok."""

    id: str
    title: str
    status: str
    finding: str
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "status": self.status,
            "finding": self.finding,
            "fix": self.fix,
            "details": self.details,
        }


@dataclass
class Report:
    checks: list[CheckResult]
    versions: dict[str, Any]
    require_gpu: bool = False
    gpu_backend: bool | None = None  # True when JAX computed on a GPU; None when unknown
    elapsed_s: float = 0.0

    @property
    def summary(self) -> dict[str, int]:
        counts = {OK: 0, WARN: 0, FAIL: 0}
        for c in self.checks:
            counts[c.status] = counts.get(c.status, 0) + 1
        return counts

    @property
    def exit_code(self) -> int:
        if any(c.status == FAIL for c in self.checks):
            return 1
        if self.require_gpu and self.gpu_backend is not True:
            return 1
        return 0

    def check(self, check_id: str) -> CheckResult:
        for c in self.checks:
            if c.id == check_id:
                return c
        raise KeyError(check_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.exit_code == 0,
            "exit_code": self.exit_code,
            "require_gpu": self.require_gpu,
            "gpu_backend": self.gpu_backend,
            "summary": self.summary,
            "checks": [c.to_dict() for c in self.checks],
            "versions": self.versions,
            "elapsed_s": round(self.elapsed_s, 2),
        }


@dataclass
class Check:
    """One registered check. ``run_checks`` reads ``run`` when it runs, so a test replaces a check
    with ``monkeypatch.setattr(the_check, "run", fake)`` on the object itself. ``applies``: when
    set, the check runs only where it returns True (``--model``'s fit only when a model is given)."""

    id: str
    title: str
    run: Callable[[Context], CheckResult]
    applies: Callable[[Context], bool] | None = None
