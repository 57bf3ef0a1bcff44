"""Faults: injected slowdowns, link degradations and kills (emulation), straggler detection, calibration."""
