"""Token-capture proxy: speaks each harness's wire API, calls the engine with
token ids, and records exactly what was sampled (see WORKSPACE.md).

Import from the submodules (`proxy.app`, `proxy.service`, `proxy.session`,
`proxy.render`, ...): this package loads none of them, so taking `render`
does not pull in the Starlette app."""
