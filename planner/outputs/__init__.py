"""What people and machines read: tables, the order sheet and its pictures, order.json, sky.yaml, campaign reports."""
