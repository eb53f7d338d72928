"""Integration with serving engines (optional; nothing here is imported by quantkit itself)."""
