"""The tracer and the compile chain a traced step goes through: memory policy, passes, backend
(``chain``)."""
