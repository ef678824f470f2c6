"""Deployment files. The launchers render the Jinja templates in slurm/ and kubernetes/, which
are installed as package data (posttrain.stages.launch.commands.templates); the rest (Dockerfile,
compose files, the Helm chart) is used from the repository."""
