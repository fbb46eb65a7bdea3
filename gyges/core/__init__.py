"""The bottom layer of the package: the error hierarchy (errors), sizes (units), argument checks
(checks) and the fair lock every public object takes (fairlock). Imports nothing of gyges but
the extension."""
