"""The check functions, one module per part of the contract; `suite` registers them."""
