"""The machine's limits in one place, bottom to top: ``sweep`` times figures in rounds across a run, ``ceilings``
measures the machine's own (the best matmul rate per dtype over a sweep of shapes, the bandwidth of a copy and a
read, the launch overhead), ``peaks`` holds the datasheets' peaks and MFU, ``roofline`` sets a training step against
both. Every page that reads MFU or MBU against a measured ceiling reads the one ``ceilings`` keeps.

Imports the core, the serving study's bandwidth table and cache reader; nothing above the studies.
"""
