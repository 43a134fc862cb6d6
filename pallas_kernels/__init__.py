"""Pallas kernels for jaxspeed, importable on their own.

The block-sparse attention and MoE dispatch/combine kernels land with their issues; this
package is installed alongside `jaxspeed` so they have a home.
"""
