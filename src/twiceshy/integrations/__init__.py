"""Adapters for agent frameworks, one module per framework, each behind its own extra.

Each module imports its framework at the top, so importing one costs nothing for users of another.
All of them hand a tool call to a :class:`twiceshy.Guard` and turn ``OutcomeUnknown`` and
``InProgress`` into the framework's own way of telling the model, without inviting a retry.
"""
