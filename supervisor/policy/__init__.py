"""Pure decisions: the state model, exit classification, restart/backoff/give-up, the resume choice and one
attempt's rules. No `os`, `time` or `random` here (an import contract checks it): effects come in as values."""
