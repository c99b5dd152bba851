"""The eager reference step every faster route is held to (``reference``).

Details: docs/modules.md, ``slimopt.optim.routes.reference.reference``.
"""
