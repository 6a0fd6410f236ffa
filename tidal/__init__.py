"""tidal"""
