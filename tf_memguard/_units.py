"""Byte sizes: parsing what users write, and printing what they should read."""
import numbers
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.I)

HELP = "a positive number of bytes, a fraction in (0, 1], or a string like '6GB' or '512MiB'"


def parse_bytes(value, total, name="max_bytes"):
    """Turns `value` into a number of bytes.

    Accepts an int (bytes), a float in (0, 1] (that fraction of `total`), or a string:
    a number with an optional unit, decimal (KB, MB, GB, TB) or binary (KiB, MiB, GiB,
    TiB; K, M, G, T alone are binary too), or a percentage ("50%").

    Raises:
        ValueError: naming the argument and its value when it is none of these.
    """
    def bad(why=HELP):
        return ValueError(f"{name}={value!r}: must be {why}")

    if isinstance(value, bool) or (hasattr(value, "dtype") and value.dtype == bool):
        raise bad()
    if isinstance(value, numbers.Integral):  # int, numpy's integers
        if value <= 0:
            raise bad()
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):  # float, numpy's floats
        value = float(value)
        if not (0.0 < value <= 1.0):
            raise bad("a fraction in (0, 1] when it is a float (for bytes, pass an int)")
        return max(1, int(total * value))
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("%"):
            try:
                pct = float(text[:-1])
            except ValueError:
                raise bad() from None
            if not (0.0 < pct <= 100.0):
                raise bad("a percentage in (0, 100]")
            return max(1, int(total * pct / 100.0))
        m = _PATTERN.match(text)
        if not m or m.group(2).lower() not in _UNITS:
            raise bad()
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if n <= 0:
            raise bad()
        return n
    raise bad()


def format_bytes(n):
    """'1.25 GiB', '512 B': the same format as the core's messages."""
    n = int(n)
    sign = "-" if n < 0 else ""
    v = float(abs(n))
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"]
    u = 0
    while v >= 1024.0 and u < len(units) - 1:
        v /= 1024.0
        u += 1
    if u == 0:
        return f"{sign}{abs(n)} B"
    if v >= 100.0:
        return f"{sign}{v:.0f} {units[u]}"
    return f"{sign}{v:.{1 if v >= 10.0 else 2}f} {units[u]}"
