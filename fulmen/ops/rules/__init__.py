"""The rules of ops, and what a rule's author writes them with: `tables` (one table per kind, filled through
`register`), and the small API of each kind of rule. These modules import only fulmen.core and the leaves of
fulmen.ops (prims, impls, registry), so an op's family module can hold its rules next to its symbol."""
