"""One run: how its worker groups and data are built, the `Run` of one attempt, its journal and its reporting."""
