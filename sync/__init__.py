"""redline.sync"""
