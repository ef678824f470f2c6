"""The configs posttrain ships: the embedded demo DAG (demo.yaml, what `posttrain run` and `make
demo` run by default), the GRPO example (grpo.yaml) and a DAG over user-style files (user_data.yaml
with data/). Installed as package data, so a wheel alone runs the demo."""
