"""Configuration: what a lorabus config may say and how a file becomes one.

`schema` (the typed shape, defaults, docs), `loader` (file -> validated `LorabusConfig`),
`rules` (the checks that span fields, pure functions of a config), `areal` (an AReaL YAML
translated to lorabus keys, as tables), `runconfig` (the keys one run of a fleet may set over the
fleet's config) and `cli` (`lorabus config`).
Nothing here touches the bus, the store or a model: a config is checked with no network.
"""
