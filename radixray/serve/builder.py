"""``radixray.build_app``: the Ray Serve application for a ServeConfig.

Usable from Python (``serve.run(build_app(cfg))``), from ``serve run
radixray:build_app config_file=configs/serve/default.yaml`` (an application
builder: Serve passes the ``key=value`` args as a dict), and from ``serve
deploy`` / RayService YAML (``import_path: radixray:build_app`` plus ``args``).
"""

from __future__ import annotations

from radixray.cluster.config import ServeConfig, merge


def build_app(config=None):
    """Build the Serve application.

    ``config``: a ServeConfig, a dict of its fields (``engine``/``server``
    sections), or None for defaults. A ``config_file`` key loads that YAML first
    and the rest of the dict overrides it. Raises ConfigError naming bad fields.
    """
    from radixray.serve.ingress import ingress_deployment
    cfg = resolve_config(config)
    return ingress_deployment(cfg).bind(cfg.model_dump())


def resolve_config(config) -> ServeConfig:
    if isinstance(config, ServeConfig):
        return config
    data = dict(config or {})
    path = data.pop("config_file", None)
    if path:
        return ServeConfig.load(path, data)
    return ServeConfig.parse(merge({}, data))
