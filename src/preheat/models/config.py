"""Model configs as diffusers and transformers write them (``config.json``), parsed in one place.

Every model's config is a frozen dataclass with diffusers' (or transformers') field names and
defaults. ``JsonConfig.from_checked_dict`` is the one reading of a ``config.json``: the class
name checked, unknown keys refused by name, JSON lists made tuples, then the config's own
``validate``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

from preheat.errors import UnsupportedConfigError

__all__ = ["JsonConfig"]


def _tuples(value: Any) -> Any:
    """JSON lists, nested too, as tuples (configs are frozen and hashable)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class JsonConfig:
    """Mixin for config dataclasses: ``to_dict`` gives diffusers' JSON shape (tuples as lists)."""

    @classmethod
    def from_checked_dict(cls, raw: Mapping[str, Any], source: str, class_name: str | None, *,
                          strict: bool = True) -> Any:
        """A config from a ``config.json``, refused in one line naming the problem and ``source``.

        ``class_name``: diffusers' ``_class_name`` this dataclass reads (None: the caller checks
        transformers' ``architectures`` itself). ``strict``: a key this dataclass does not know is
        refused (diffusers' configs: an unknown key is an option preheat would silently ignore);
        transformers' configs carry many keys that change nothing here, so theirs are read with
        ``strict=False``. Then ``validate(source)``."""
        if class_name is not None:
            name = raw.get("_class_name", class_name)
            if name != class_name:
                raise UnsupportedConfigError(f"unsupported model class {name!r} in {source}; supported: {class_name!r}")
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        if strict:
            unknown = sorted(k for k in raw if not k.startswith("_") and k not in known)
            if unknown:
                raise UnsupportedConfigError(
                    f"unsupported {class_name or cls.__name__} config key(s) {', '.join(unknown)} in {source}; "
                    f"supported keys: {', '.join(sorted(known))}")
        config = cls(**{k: _tuples(v) for k, v in raw.items() if k in known})
        config.validate(source)  # type: ignore[attr-defined]
        return config

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple) else value
        return out
