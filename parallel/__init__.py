import compat  # noqa: F401  (its upstream import adjustments precede any upstream import of this package)
