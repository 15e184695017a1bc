"""The recipes that ship with lctrain (YAML files beside this one); `tiny.yaml` is the default."""
