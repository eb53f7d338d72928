class FakePlatform:
    pass


current_platform = FakePlatform()
