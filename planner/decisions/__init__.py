"""From lines, campaign and catalog to decisions: which lines size the campaign, the selection sheet, rental windows
and the budget."""
