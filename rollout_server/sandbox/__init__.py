"""Trial sandboxes: Docker containers (isolated, `sandbox.docker`) or a local
temp dir (unisolated, `sandbox.local`), both behind `sandbox.base.Sandbox`;
`sandbox.factory.SandboxFactory` picks one per server and makes one per trial.
This package loads none of its modules: import from them."""
