"""Scripts that run ``train.py`` with a bug injected from outside the product, so tests can show
that a check catches that bug (a check nobody has seen fail proves nothing)."""
