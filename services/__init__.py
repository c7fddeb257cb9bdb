"""The face: the `sluice` command and the launchers of each service."""
