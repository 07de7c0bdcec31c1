"""A user's own package: TaskModules that live outside taskfit, trained with the `taskfit`
command."""
