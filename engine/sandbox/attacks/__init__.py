"""`python -m engine attacks`: hostile programs run through the real sandbox, each verdict observed from outside."""
